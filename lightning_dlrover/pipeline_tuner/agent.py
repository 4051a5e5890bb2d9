"""The RL agent that splits a CPU budget across the pipeline's stages (InTune-style), online.

What it measures: **the end-to-end rate**, samples per second of wall time over whole training steps (the
window runs from the end of one step to the end of a later one, so the trainer's own step time is in it, not
only the time it waited for data). On few cores that is what a pipeline setting changes most: its threads
and processes share the trainer's cores (and a thread the trainer's GIL), so a setting under which the trainer
never waits can still make every step slower. The consumer's wait fraction and the stages' utilisation only
describe the state; the reward and every keep-or-undo decision are on the end-to-end rate.

Design (one decision per measurement window, ``window_s`` seconds each):

- **Incumbent and trials**: the agent holds an *incumbent* configuration (first: the start, i.e. the pipeline
  the user configured). A trial is one action applied to it, giving a *candidate*, measured interleaved with
  the incumbent: ``I C I C I C I`` (``pairs`` candidate windows, each compared with the mean of the incumbent
  windows on either side of it, so a drift of the machine's load cancels; the incumbent's window before a
  trial is the last one of the previous trial). A candidate is **kept only if it beats the incumbent in every
  pair by ``min_gain`` (3%), and on average by twice the incumbent's own noise** (the median half-difference
  of its adjacent windows; a candidate clearly ahead after two pairs, or by twice that margin after one, is kept
  at once); the first pair that does not ends the trial (two windows for a plain loser), and
  the candidate is **undone** (back to the incumbent). So a tuner that finds no gain keeps the start, and no
  comparison is against a stale number. The job's first window is a warm-up and not compared.
- **State**: the bottleneck, read from the incumbent's last window: the consumer (``trainer``) when it waited
  for data less than 5% of the window (``trainer_slowed`` when its own time per sample is 15% above the
  least seen in any configuration: the pipeline takes cores from it), else the stage whose workers were
  busiest, and a second stage at least 85% as busy if any; the idlest other staffed stage; the memory level
  (predicted pipeline memory under 50%, 80% or above of the budget); whether the CPU limit is spent.
- **Actions**: add workers to a stage (or to two at once; half as many again, at least one), remove one, move
  one between stages, fuse a stage into the next staffed one (its workers join that stage, whose processes then
  run both: one hand-over fewer per batch), prefetch +1 / -1 (down to 0), double every staffed stage and the
  prefetch, halve them
  (down to all inline, nothing prefetched). Eligible:
  a different configuration within the CPU limit (the budget, or the start's workers if the user started
  above it: the agent never adds beyond either), the prefetch limit and (predicted) the memory budget, and
  not already rejected from this incumbent.
- **Reward**: the trial's mean paired gain of the end-to-end rate (candidate / incumbent - 1), minus
  ``memory_penalty`` x (how far the candidate's measured memory went above 80% of the budget, in units of the
  last 20%), minus ``change_cost``.
- **Learning**: tabular Q-learning over (state, action), ``Q += alpha * (r + gamma * max Q(s') - Q)``, with a
  prior from the bottleneck: when a stage is the bottleneck, adding workers to it (+0.2), to it and the second
  busiest stage (+0.18), moving one to it from the idlest stage (+0.15), fusing a stage once the CPU limit is spent
  (+0.12), doubling (+0.1), prefetch +1 (+0.05);
  when the trainer is, fewer workers (halve +0.1, removing a read or assemble thread +0.08, removing the
  idlest stage's +0.06, prefetch -1 +0.04); everything else -0.05. Epsilon-greedy (``epsilon``, times
  ``decay`` per trial) among the eligible actions.
- **Stopping**: after ``patience`` rejected trials in a row, ``max_trials`` trials, or when no eligible action
  is left, it keeps the incumbent and stops changing it (no further resets); windows then last 3x longer. It
  explores again when the rate stays below 80% of the incumbent's for 3 windows (the consumer or data changed).
- **Memory guard**: a measured pipeline memory within 5% of the budget sheds a worker at once (that becomes
  the incumbent).

Cost: a rejected trial is 2 windows, a kept one 5-7, each switch a pipeline reset (a rebuild at the current
sample, 0.2-0.5 s on 2 cores). On few cores the trainer is the bottleneck: a job that names no workers starts from
everything inline in one prefetch thread (:func:`~lightning_dlrover.data.staged.for_machine`), and the prior tries
fewer workers first. On a quiet 2-core machine (``bench/bench_pipeline_oracle.py``, 4 interleaved rounds) the agent
kept that start in 10 of 12 runs and ended at 0.98 of the grid oracle at 2 ranks and 0.99-1.06 at 1 rank (two runs),
1.00-1.07x the start, 1.09-1.20x ``PipelineConfig()`` (from which it had reached 0.90-0.95: the 4% between
prefetch 1 and all inline is within the noise of its 2-second windows, so it could not climb there). On many cores a parse-bound pipeline is the
bottleneck and the agent grows the busy stages geometrically (1, 2, 3, 4, 6, 9...), fuses stages once the cores are
spent, and keeps a large gain after one pair. On a model calibrated on that machine (``bench/bench_pipeline_scale.py``,
a trainer at 2M-8M samples/s, 8-64 cores) it ends at 0.95-1.00 of the grid oracle within 2 minutes of pipeline time,
where the hill climber stops at 0.48-0.68 on 8-16 cores; at 400k samples/s the trainer is the limit beyond ~3
workers and every tuner gets there in seconds.

At 2+ ranks one agent decides for all (rank 0's, on the ranks' combined observations:
:mod:`~lightning_dlrover.pipeline_tuner.joint`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lightning_dlrover.data.staged import STAGES, PipelineConfig
from lightning_dlrover.pipeline_tuner.observe import Budget, MemoryGuard, Observation

# ("add", s) | ("add", s, s2) | ("remove", s) | ("move", src, dst) | ("fuse", s) | ("prefetch", +1 | -1)
# | ("scale", 2 | 0.5)
Action = tuple


@dataclass(frozen=True)
class Decision:
    """What a tuner did after a window: ``config`` applied next (``None``: unchanged), and why."""

    observed: Observation
    config: PipelineConfig | None
    reason: str
    predicted_memory: int


def apply_action(config: PipelineConfig, action: Action) -> PipelineConfig | None:
    """The configuration after ``action``, or ``None`` if it is impossible (no worker to remove). A stage may go
    down to 0 workers (it then runs inline in the thread that pulls from it), the prefetch down to 0. ``add``
    grows a stage by half its workers (at least one), so many cores are reached in few steps."""
    kind = action[0]
    if kind == "add":
        return config.replace(**{s: config.workers[s] + max(1, config.workers[s] // 2) for s in action[1:]})
    if kind == "remove":
        n = config.workers[action[1]]
        return config.replace(**{action[1]: n - 1}) if n > 0 else None
    if kind == "move":
        src, dst = action[1], action[2]
        if config.workers[src] < 1:
            return None
        return config.replace(**{src: config.workers[src] - 1, dst: config.workers[dst] + 1})
    if kind == "fuse":  # the stage's workers join the next staffed stage, whose workers then run it too
        stage = action[1]
        after = next((t for t in STAGES[STAGES.index(stage) + 1:] if config.workers[t] > 0), None)
        if config.workers[stage] < 1 or after is None:
            return None
        return config.replace(**{stage: 0, after: config.workers[after] + config.workers[stage]})
    if kind == "prefetch":
        p = config.prefetch + action[1]
        return config.replace(prefetch=p) if p >= 0 else None
    if kind == "scale":
        f = action[1]
        scaled = config.replace(**{s: int(w * f) for s, w in config.workers.items()}, prefetch=int(config.prefetch * f))
        return scaled if scaled != config else None
    return config


def shrink(config: PipelineConfig, guard: MemoryGuard) -> PipelineConfig:
    """``config`` made at least one step smaller until the guard allows it: prefetch first, then workers of the
    in-process stages (read, assemble), then transform, parse last, so that the heavy stages stay out of the
    training process as long as the budget allows; all-inline with prefetch 1 at the least."""
    smaller = config.replace(prefetch=max(1, config.prefetch - 1))
    while not guard.allows(smaller) or smaller == config:
        stage = next((s for group in (("read", "assemble"), ("transform",), ("parse",))
                      for s in sorted(group, key=lambda g: -smaller.workers[g]) if smaller.workers[s] > 0), None)
        if stage is None:
            return smaller
        smaller = smaller.replace(**{stage: smaller.workers[stage] - 1})
    return smaller


ACTIONS: list[Action] = ([("add", s) for s in STAGES] + [("remove", s) for s in STAGES]
                         + [("add", a, b) for i, a in enumerate(STAGES) for b in STAGES[i + 1:]]
                         + [("move", a, b) for a in STAGES for b in STAGES if a != b]
                         + [("fuse", s) for s in STAGES[:-1]]
                         + [("prefetch", 1), ("prefetch", -1), ("scale", 2), ("scale", 0.5)])


class RLTuner:
    """Q-learning agent over per-stage workers and prefetch depth, judged on the end-to-end rate (see the module
    docstring).

    Args:
        budget: CPU and memory budget of the pipeline.
        start: first configuration and first incumbent (default: one worker per stage, prefetch 2); kept unless a
            change beats it. It may use more workers than ``budget.cpus`` (the agent then never adds beyond it).
        epsilon, decay: exploration rate and its decay per trial.
        alpha, gamma: learning rate and discount.
        patience: rejected trials in a row before stopping.
        min_gain: relative gain a candidate must show in every pair (and on average, at least twice the
            incumbent's own window-to-window noise) to be kept.
        pairs: candidate windows per trial, each against the incumbent windows around it.
        max_trials: stop after this many trials regardless.
        memory_penalty, change_cost: terms of the reward.
        seed: seed of the exploration.
    """

    name = "rl"

    def __init__(self, budget: Budget, start: PipelineConfig | None = None, epsilon: float = 0.1,
                 decay: float = 0.8, alpha: float = 0.5, gamma: float = 0.3, patience: int = 3,
                 min_gain: float = 0.03, pairs: int = 3, max_trials: int = 16, memory_penalty: float = 2.0,
                 change_cost: float = 0.01, methods: dict[str, str] | None = None, seed: int = 0) -> None:
        if pairs < 1 or patience < 1:
            raise ValueError(f"RLTuner(pairs={pairs}, patience={patience}): both must be >= 1.")
        self.budget = budget
        self.start = start or PipelineConfig(1, 1, 1, 1, 2)
        # the start may be above the CPU budget (the user's own setting): the agent adds nothing beyond it
        self.cpu_limit = max(budget.cpus, self.start.total_workers)
        self.guard = MemoryGuard(Budget(self.cpu_limit, budget.memory_bytes, budget.max_prefetch), methods)
        self.epsilon, self.decay, self.alpha, self.gamma = epsilon, decay, alpha, gamma
        self.patience, self.min_gain, self.pairs, self.max_trials = patience, min_gain, pairs, max_trials
        self.memory_penalty, self.change_cost = memory_penalty, change_cost
        self.rng = random.Random(seed)
        self.q: dict[tuple, dict[Action, float]] = {}
        self.means: dict[PipelineConfig, tuple[float, int]] = {}  # every window's end-to-end rate, per config
        self.done = False
        self.decisions = self.trials = self.rejected_in_a_row = 0
        self.incumbent = self.first()
        self.kept_start = True
        self._trial: dict | None = None  # state, action, candidate, incumbent and candidate windows
        self._inc_windows: list[float] = []  # the incumbent's windows since the trial began (or the last one)
        self._rejected: dict[PipelineConfig, set[PipelineConfig]] = {}
        self._fastest_consumer: float | None = None  # least consumer seconds per sample seen
        self._low_windows = 0
        self._noise: list[float] = []

    def first(self) -> PipelineConfig:
        """The configuration to start with (shrunk to the budget if needed)."""
        return self.start if self.guard.allows(self.start) else shrink(self.start, self.guard)

    @property
    def best(self) -> PipelineConfig:
        """The incumbent: the start, or the last candidate that beat the configuration it was compared with."""
        return self.incumbent

    def _state(self, obs: Observation) -> tuple:
        if obs.wait_fraction < 0.05:
            slowed = (self._fastest_consumer is not None
                      and obs.consumer_s_per_sample > 1.15 * self._fastest_consumer)
            bottleneck = "trainer_slowed" if slowed else "trainer"
        else:
            bottleneck = max(STAGES, key=lambda s: obs.utilisation[s])
        # a second stage nearly as busy: adding to the bottleneck alone would only move it there
        busy = max(obs.utilisation.values())
        co = next((s for s in sorted(STAGES, key=lambda s: -obs.utilisation[s]) if s != bottleneck
                   and bottleneck in STAGES and obs.utilisation[s] >= 0.85 * busy > 0), None)
        staffed = [s for s in STAGES if obs.config.workers[s] >= 1 and s not in (bottleneck, co)]
        idlest = min(staffed, key=lambda s: obs.utilisation[s]) if staffed else None
        level = self.guard.predict(obs.config) / self.budget.memory_bytes
        full = obs.config.total_workers >= self.cpu_limit
        return bottleneck, idlest, 0 if level < 0.5 else 1 if level < 0.8 else 2, full, co

    def _prior(self, state: tuple, action: Action, obs: Observation) -> float:
        bottleneck, idlest, co = state[0], state[1], state[4]
        if bottleneck in STAGES:
            if action == ("add", bottleneck):
                return 0.2
            if co is not None and action == ("add", *sorted((bottleneck, co), key=STAGES.index)):
                return 0.18
            if action == ("move", idlest, bottleneck):
                return 0.15
            if action == ("scale", 2):
                return 0.1
            if action == ("prefetch", 1):
                return 0.05
            if action[0] == "fuse" and state[3]:  # no core left to add: a stage fewer saves its hand-over's CPU
                return 0.12
            return -0.05
        # the trainer is the bottleneck: the pipeline keeps up, fewer workers give the trainer its cores back
        if action == ("scale", 0.5):
            return 0.1
        if action in (("remove", "read"), ("remove", "assemble")):
            return 0.08
        if action == ("remove", idlest):
            return 0.06
        if action == ("prefetch", -1):
            return 0.04
        return -0.05

    def _values(self, state: tuple, obs: Observation) -> dict[Action, float]:
        if state not in self.q:
            self.q[state] = {a: self._prior(state, a, obs) for a in ACTIONS}
        return self.q[state]

    def _record(self, obs: Observation) -> None:
        mean, n = self.means.get(obs.config, (0.0, 0))
        self.means[obs.config] = ((mean * n + obs.samples_per_s) / (n + 1), n + 1)
        if obs.consumer_s_per_sample > 0:
            self._fastest_consumer = min(self._fastest_consumer or obs.consumer_s_per_sample,
                                         obs.consumer_s_per_sample)

    def step(self, obs: Observation, worker_bytes: list[int] | None = None) -> Decision:
        """Learns from the window ``obs`` (its end-to-end rate) and decides the next configuration."""
        self.guard.update(obs.config, worker_bytes or [], obs.batch_bytes)
        self._record(obs)
        self.decisions += 1
        if obs.memory_bytes > 0.95 * self.budget.memory_bytes:  # measured near the limit: shed now
            smaller = shrink(obs.config, self.guard)
            self._trial, self._inc_windows, self.incumbent = None, [], smaller
            self.kept_start = False
            return Decision(obs, smaller, "memory guard: measured memory within 5% of the budget, shedding a worker",
                            self.guard.predict(smaller))
        if self.done:
            return self._watch(obs)
        trial = self._trial
        if trial is not None and obs.config == trial["candidate"]:
            trial["cand"].append(obs.samples_per_s)
            trial["memory"] = max(trial["memory"], obs.memory_bytes)
            return Decision(obs, self.incumbent, f"compare: back to {self.incumbent.short()} (pair "
                            f"{len(trial['cand'])} of {self.pairs})", self.guard.predict(self.incumbent))
        if obs.config != self.incumbent:  # changed from outside (or a shed): it is the incumbent now
            self._trial, self._inc_windows, self.incumbent = None, [], obs.config
        self._inc_windows.append(obs.samples_per_s)
        if trial is None:
            if self.decisions == 1:  # the job's first window carries its warm-up
                self._inc_windows = []
                return Decision(obs, None, "warm-up window: measuring the start again", self.guard.predict(obs.config))
            return self._next_trial(obs, "")
        cand, inc = trial["cand"], self._inc_windows
        ratios = [c / max((inc[i] + inc[i + 1]) / 2, 1e-9) for i, c in enumerate(cand)]
        mean_gain = sum(ratios) / len(ratios) - 1
        self._noise.append(abs(inc[-1] - inc[-2]) / max(inc[-1] + inc[-2], 1e-9))  # the incumbent against itself
        failed = ratios[-1] <= 1 + self.min_gain
        noise = sorted(self._noise)[len(self._noise) // 2]  # median half-difference of adjacent incumbent windows
        margin = max(3 * self.min_gain, 4 * noise)
        # no third pair needed; a gain of twice the margin needs no second (a parse-bound pipeline on many cores
        # doubles with each added worker: the climb is then as many trials as the cores allow)
        clear = min(ratios) > 1 + (margin if len(ratios) >= 2 else 2 * margin)
        if not failed and not clear and len(cand) < self.pairs:
            return Decision(obs, trial["candidate"], f"compare: {trial['candidate'].short()} again "
                            f"({ratios[-1] - 1:+.1%} in the last pair)", self.guard.predict(trial["candidate"]))
        accepted = not failed and mean_gain > max(self.min_gain, 2 * noise)
        self._learn(trial, mean_gain, obs)
        gains = ", ".join(f"{r - 1:+.1%}" for r in ratios)
        what = self._describe(trial["action"])
        self._trial, self._inc_windows = None, [obs.samples_per_s]
        if accepted:
            self.incumbent, self.kept_start, self.rejected_in_a_row = trial["candidate"], False, 0
            self._inc_windows = []  # the next window (on the new incumbent) starts its comparisons
            return Decision(obs, trial["candidate"], f"keep {what}: {trial['candidate'].short()} beat "
                            f"{obs.config.short()} end to end ({gains})", self.guard.predict(trial["candidate"]))
        self.rejected_in_a_row += 1
        self._rejected.setdefault(self.incumbent, set()).add(trial["candidate"])
        return self._next_trial(obs, f"undo {what} ({gains} end to end against {self.incumbent.short()}); ")

    def _learn(self, trial: dict, gain: float, obs: Observation) -> None:
        over = max(0.0, trial["memory"] / self.budget.memory_bytes - 0.8) / 0.2
        reward = gain - self.memory_penalty * over - self.change_cost
        values = self._values(self._state(obs), obs)
        q = self.q[trial["state"]]
        q[trial["action"]] += self.alpha * (reward + self.gamma * max(values.values()) - q[trial["action"]])

    def _next_trial(self, obs: Observation, prefix: str) -> Decision:
        """On the incumbent (``obs``): starts the next trial, or stops."""
        state = self._state(obs)
        values = self._values(state, obs)
        rejected = self._rejected.get(self.incumbent, set())
        eligible = {a: v for a, v in values.items() if (c := apply_action(self.incumbent, a)) is not None
                    and c != self.incumbent and c not in rejected and self.guard.allows(c)}
        why = ("no eligible change left" if not eligible else f"{self.rejected_in_a_row} changes in a row did not "
               f"beat it" if self.rejected_in_a_row >= self.patience else f"{self.trials} trials"
               if self.trials >= self.max_trials else None)
        if why is not None:
            self.done, self._low_windows = True, 0
            start = "the start " if self.kept_start else ""
            return Decision(obs, None, f"{prefix}converged ({why}): keeping {start}{self.incumbent.short()}",
                            self.guard.predict(self.incumbent))
        if self.rng.random() < self.epsilon:
            action, how = self.rng.choice(sorted(eligible, key=repr)), "explore"
        else:
            action, how = max(eligible.items(), key=lambda kv: kv[1])[0], "greedy"
        self.epsilon *= self.decay
        self.trials += 1
        candidate = apply_action(self.incumbent, action)
        self._trial = {"state": state, "action": action, "candidate": candidate, "cand": [], "memory": 0}
        return Decision(obs, candidate, f"{prefix}{how} try {self._describe(action)} -> {candidate.short()} "
                        f"(bottleneck {state[0]})", self.guard.predict(candidate))

    def _watch(self, obs: Observation) -> Decision:
        reference = self.means[self.incumbent][0] if self.incumbent in self.means else obs.samples_per_s
        self._low_windows = self._low_windows + 1 if obs.samples_per_s < 0.8 * reference else 0
        if self._low_windows >= 3 and obs.config == self.incumbent:
            self.done, self.epsilon, self.rejected_in_a_row, self.trials = False, 0.2, 0, 0
            self.means, self._rejected, self._inc_windows = {obs.config: (obs.samples_per_s, 1)}, {}, []
            return self._next_trial(obs, "the rate fell below 80% of the kept configuration's for 3 windows: "
                                    "exploring again; ")
        return Decision(obs, None, f"converged: keeping {self.incumbent.short()}", self.guard.predict(obs.config))

    @staticmethod
    def _describe(action: Action) -> str:
        if action[0] == "move":
            return f"move a worker {action[1]} -> {action[2]}"
        if action[0] == "fuse":
            return f"fuse {action[1]} into the next stage's workers"
        if action[0] == "prefetch":
            return f"prefetch {action[1]:+d}"
        if action[0] == "scale":
            return "double" if action[1] > 1 else "halve"
        return " ".join(map(str, action))
