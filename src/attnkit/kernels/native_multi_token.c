/* Multi-token attention loops (arXiv 2504.00927). */
#include "native_common.h"
