/* Native Sparse Attention loops (arXiv 2502.11089). */
#include "native_common.h"
