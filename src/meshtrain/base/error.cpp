#include "meshtrain/base/error.h"

// error.h is header-only; this file gives the base layer a translation unit.
namespace mt {}
