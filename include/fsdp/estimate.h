#pragma once
// Deprecated: the estimator is a tool's API and lives in <fsdp/tools/estimate.h>, which
// <fsdp/fsdp.h> does not include. This header goes in the next release (CHANGELOG.md).
#pragma GCC warning "<fsdp/estimate.h> is deprecated: include <fsdp/tools/estimate.h>"
#include <fsdp/tools/estimate.h>
