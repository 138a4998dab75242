message(FATAL_ERROR "cuda backend: in progress")
