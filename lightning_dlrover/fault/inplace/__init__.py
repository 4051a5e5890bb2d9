"""In-process recovery (``lightning-dlrover launch``): who is in the job (:mod:`.membership`, in the launcher's
store), a world group whose communicator can be replaced (:mod:`.process_group`), the survivor and replacement
sides of a recovery (:mod:`.protocol`, :mod:`.agree`) and the launcher's supervisor of workers and spares
(:mod:`.supervisor`). Nothing here imports Lightning or TorchRec."""
