"""Foundation shared by the op families: hardware queries, implementation registry, timing."""
