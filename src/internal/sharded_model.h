#pragma once
// Every view of the model view at once (model_view.h and the views one per client), for
// the tests. The library's folders include their own view only.

#include "checkpoint_view.h"
#include "model_view.h"
#include "optim_view.h"
#include "pipeline_view.h"
#include "train_view.h"
