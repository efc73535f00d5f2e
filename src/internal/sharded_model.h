#pragma once
// Every view of the model view at once (model_view.h and the views one per client), for
// the tests. The library's folders include their own view only.

#include "internal/checkpoint_view.h"
#include "internal/model_view.h"
#include "internal/optim_view.h"
#include "internal/pipeline_view.h"
#include "internal/train_view.h"
