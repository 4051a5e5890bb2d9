"""The vocabulary of drills: the fault injector's (its environment variable, fault points, signals and targets)
and the restored job's parity check, apart from :mod:`.injector` so that launchers (``lightning-dlrover chaos``)
use it without importing Lightning."""

#: Environment variable read by :meth:`~lightning_dlrover.fault.FaultInjector.from_env`.
FAULT_ENV = "LIGHTNING_DLROVER_FAULT"
#: The fault points of a training step, in the order they are reached.
PHASES = ("before_forward", "after_optimizer", "during_parity_commit", "during_vote")
#: Fault points outside a training step (see :mod:`.injector`).
RECOVERY_PHASES = ("during_recovery",)
#: Signals the injector can send; ``error`` raises ``RuntimeError`` in the rank instead (it does not die).
SIGNALS = ("SIGKILL", "SIGTERM", "error")
TARGETS = ("rank", "node", "all")
ENV_FORMAT = "rank=R[+R...],step=S,phase=P[,signal=SIGKILL|SIGTERM|error] or step=S,phase=P,target=node|all"
#: Environment variable: ``1`` makes every rank that reaches a fault's point under ``lightning-dlrover launch`` first wait
#: (at most :data:`SPARES_TIMEOUT_S`) until a hot spare waits for a rank, so a drill measures a hot spare's recovery (on
#: a busy machine an idle-priority spare may still be importing when the point is reached). Every rank waits, none in a
#: collective, so no collective times out meanwhile.
WAIT_FOR_SPARES_ENV = "LIGHTNING_DLROVER_FAULT_WAITS_FOR_SPARES"
SPARES_TIMEOUT_S = 600.0

#: Environment variable: ``1`` checks the parity of a restored job against a fresh encode (drills; costs an encode).
VERIFY_PARITY_ENV = "LIGHTNING_DLROVER_VERIFY_PARITY"
#: ``1``: after a grow in process, rank 0 compares the digest of the whole training state with the committed state's
#: before it (``resize_verified`` event; a collective that gathers every table: for drills and tests).
VERIFY_RESIZE_ENV = "LIGHTNING_DLROVER_VERIFY_RESIZE"
