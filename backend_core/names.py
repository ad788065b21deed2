"""Names shared across the package, defined once (standard library only: the plugin entry points
import this before any framework or kernel library)."""

FLYDSL = "flydsl"  # the backend name users pass (--attention-backend flydsl, backend="flydsl")
FLYDSL_ARCHES = ("gfx950", "gfx942")  # the AMD architectures FlyDSL kernels are built and checked for
