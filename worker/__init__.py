from shared.blas_threads import set_openblas_thread_timeout

set_openblas_thread_timeout()   # before anything in the worker imports numpy
