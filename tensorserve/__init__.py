from shared.blas_threads import set_openblas_thread_timeout

set_openblas_thread_timeout()   # before the CLI imports numpy (tensorserve generate runs the model in process)
