"""The RL agent that splits a CPU budget across the pipeline's stages (InTune-style), online.

Design (one decision per measurement window, a few seconds each):

- **State**: the bottleneck, read from the last window: the consumer (``trainer``) when it waited for data
  less than 5% of the window, else the stage whose workers were busiest (utilisation = busy seconds per
  worker-second); the idlest other stage that has a worker (the donor of a move); the memory level
  (predicted pipeline memory under 50%, 80% or above of the budget); whether the CPU budget is spent.
- **Actions**: add a worker to a stage, remove one, move one from a stage to another, prefetch +1 / -1, stay.
  Only actions whose result passes the guard are eligible: total workers within the CPU budget, prefetch
  within its limit, predicted memory within the memory budget (a hard limit, checked before a change).
- **Reward**: relative change of delivered samples/s against the mean of the configuration the action left, minus
  ``memory_penalty`` x (how far measured memory went above 80% of the budget, in units of the last 20%),
  minus ``change_cost`` for any change (it costs a pipeline reset).
- **Learning**: tabular Q-learning, ``Q(s,a) += alpha * (r + gamma * max Q(s',.) - Q(s,a))``, with a prior
  from the bottleneck (adding or moving a worker to the bottleneck starts at +0.2, at it from the idlest
  stage +0.15, prefetch +1 when the consumer waits +0.01, removing from an idle stage +0.02, staying +0.05
  when the trainer is the bottleneck and 0 otherwise, everything else -0.05), so the first greedy choices are the sensible ones and exploration corrects the prior.
- **Exploration**: epsilon-greedy, epsilon starting at ``epsilon`` and multiplied by ``decay`` each decision.
  An action that lost more than ``undo_below`` (5%) is undone at the next decision (back to the best configuration), so
  exploration costs one window at most.
- **Stopping**: once epsilon is below ``min_epsilon`` (or after ``max_decisions``) and ``patience`` decisions
  in a row brought no gain above ``min_gain`` over the best mean, the agent applies the best configuration
  and stops changing it (no further resets). It wakes up (epsilon 0.2) when delivered throughput stays below
  80% of the best for 3 windows, e.g. when the consumer or the data changed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lightning_dlrover.data.staged import STAGES, PipelineConfig
from lightning_dlrover.pipeline_tuner.observe import Budget, MemoryGuard, Observation

Action = tuple  # ("add", s) | ("remove", s) | ("move", src, dst) | ("prefetch", +1 | -1) | ("stay",)


@dataclass(frozen=True)
class Decision:
    """What a tuner did after a window: ``config`` applied next (``None``: unchanged), and why."""

    observed: Observation
    config: PipelineConfig | None
    reason: str
    predicted_memory: int


def apply_action(config: PipelineConfig, action: Action) -> PipelineConfig | None:
    """The configuration after ``action``, or ``None`` if it is impossible (no worker to remove). A stage may go
    down to 0 workers (it then runs inline in the thread that pulls from it)."""
    kind = action[0]
    if kind == "add":
        return config.replace(**{action[1]: config.workers[action[1]] + 1})
    if kind == "remove":
        n = config.workers[action[1]]
        return config.replace(**{action[1]: n - 1}) if n > 0 else None
    if kind == "move":
        src, dst = action[1], action[2]
        if config.workers[src] < 1:
            return None
        return config.replace(**{src: config.workers[src] - 1, dst: config.workers[dst] + 1})
    if kind == "prefetch":
        p = config.prefetch + action[1]
        return config.replace(prefetch=p) if p >= 1 else None
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
                         + [("move", a, b) for a in STAGES for b in STAGES if a != b]
                         + [("prefetch", 1), ("prefetch", -1), ("stay",)])


class RLTuner:
    """Q-learning agent over per-stage workers and prefetch depth (see the module docstring).

    Args:
        budget: CPU and memory budget of the pipeline.
        start: first configuration (default: one worker per stage, prefetch 2).
        epsilon, decay, min_epsilon: exploration rate, its decay per decision, and the stopping threshold.
        alpha, gamma: learning rate and discount.
        patience: decisions without a gain above ``min_gain`` before stopping.
        max_decisions: stop exploring after this many decisions regardless.
        memory_penalty: weight of the memory term of the reward.
        seed: seed of the exploration.
    """

    name = "rl"

    def __init__(self, budget: Budget, start: PipelineConfig | None = None, epsilon: float = 0.3,
                 decay: float = 0.85, min_epsilon: float = 0.08, alpha: float = 0.5, gamma: float = 0.3,
                 patience: int = 4, min_gain: float = 0.03, max_decisions: int = 40, memory_penalty: float = 2.0,
                 change_cost: float = 0.02, undo_below: float = 0.05, methods: dict[str, str] | None = None, seed: int = 0) -> None:
        self.budget, self.guard = budget, MemoryGuard(budget, methods)
        self.start = start or PipelineConfig(1, 1, 1, 1, 2)
        self.epsilon, self.decay, self.min_epsilon = epsilon, decay, min_epsilon
        self.alpha, self.gamma, self.patience, self.min_gain = alpha, gamma, patience, min_gain
        self.max_decisions, self.memory_penalty, self.change_cost = max_decisions, memory_penalty, change_cost
        self.undo_below = undo_below
        self.rng = random.Random(seed)
        self.q: dict[tuple, dict[Action, float]] = {}
        self.means: dict[PipelineConfig, tuple[float, int]] = {}
        self.done = False
        self.decisions = 0
        self._since_gain = 0
        self._low_windows = 0
        self._last: tuple[tuple, Action, float] | None = None  # (state, action, throughput before)

    def first(self) -> PipelineConfig:
        """The configuration to start with (shrunk to the budget if needed)."""
        return self.start if self.guard.allows(self.start) else shrink(self.start, self.guard)

    @property
    def best(self) -> PipelineConfig | None:
        return max(self.means, key=lambda c: self.means[c][0]) if self.means else None

    def _state(self, obs: Observation) -> tuple:
        if obs.wait_fraction < 0.05:
            bottleneck = "trainer"
        else:
            bottleneck = max(STAGES, key=lambda s: obs.utilisation[s])
        staffed = [s for s in STAGES if obs.config.workers[s] >= 1 and s != bottleneck]
        idlest = min(staffed, key=lambda s: obs.utilisation[s]) if staffed else None
        level = self.guard.predict(obs.config) / self.budget.memory_bytes
        full = obs.config.total_workers >= self.budget.cpus
        return bottleneck, idlest, 0 if level < 0.5 else 1 if level < 0.8 else 2, full

    def _prior(self, state: tuple, action: Action, obs: Observation) -> float:
        bottleneck, idlest = state[0], state[1]
        if bottleneck in STAGES and action == ("add", bottleneck):
            return 0.2
        if bottleneck in STAGES and action == ("move", idlest, bottleneck):
            return 0.15
        if action == ("prefetch", 1) and obs.wait_fraction > 0.05:
            return 0.01
        if action[0] == "remove" and obs.utilisation[action[1]] < 0.3:
            return 0.02
        if action == ("stay",):
            return 0.05 if bottleneck == "trainer" else 0.0  # the pipeline keeps up: little to gain, resets cost
        return -0.05

    def _values(self, state: tuple, obs: Observation) -> dict[Action, float]:
        if state not in self.q:
            self.q[state] = {a: self._prior(state, a, obs) for a in ACTIONS}
        return self.q[state]

    def _record(self, obs: Observation) -> None:
        mean, n = self.means.get(obs.config, (0.0, 0))
        self.means[obs.config] = ((mean * n + obs.samples_per_s) / (n + 1), n + 1)

    def step(self, obs: Observation, worker_bytes: list[int] | None = None) -> Decision:
        """Learns from the window ``obs`` and decides the next configuration."""
        self.guard.update(obs.config, worker_bytes or [], obs.batch_bytes)
        previous_best = self.means[self.best][0] if self.means else 0.0
        self._record(obs)
        state = self._state(obs)
        values = self._values(state, obs)
        reward = None
        if self._last is not None:
            last_state, last_action, before = self._last
            over = max(0.0, obs.memory_bytes / self.budget.memory_bytes - 0.8) / 0.2
            reward = (obs.samples_per_s - before) / max(before, 1e-9) - self.memory_penalty * over
            if last_action != ("stay",):
                reward -= self.change_cost  # a change costs a pipeline reset
            target = reward + self.gamma * max(values.values())
            self.q[last_state][last_action] += self.alpha * (target - self.q[last_state][last_action])
        gained = obs.samples_per_s > previous_best * (1 + self.min_gain)
        self._since_gain = 0 if gained else self._since_gain + 1
        self.decisions += 1
        predicted = self.guard.predict(obs.config)
        if obs.memory_bytes > 0.95 * self.budget.memory_bytes:  # measured near the limit: shed now
            self._last = None
            return Decision(obs, shrink(obs.config, self.guard), "memory guard: measured memory within 5% of the "
                            "budget, shedding a worker", self.guard.predict(shrink(obs.config, self.guard)))
        if self.done:
            return self._watch(obs, predicted)
        exhausted = self.epsilon < self.min_epsilon or self.decisions >= self.max_decisions
        if exhausted and self._since_gain >= self.patience:
            self.done, self._last = True, None
            best = self.best
            return Decision(obs, best if best != obs.config else None,
                            f"converged after {self.decisions} decisions: best {best.short()}", self.guard.predict(best))
        if reward is not None and reward < -self.undo_below and last_action != ("stay",) and self.best != obs.config:
            self._last = None
            return Decision(obs, self.best, f"undo: {reward:+.1%} after {self._describe(last_action)}",
                            self.guard.predict(self.best))
        eligible = {a: v for a, v in values.items() if a == ("stay",)
                    or ((c := apply_action(obs.config, a)) is not None and self.guard.allows(c))}
        if self.rng.random() < self.epsilon:
            action, how = self.rng.choice(sorted(eligible)), "explore"
        else:
            action, how = max(eligible.items(), key=lambda kv: kv[1])[0], "greedy"
        self.epsilon *= self.decay
        self._last = (state, action, self.means[obs.config][0])
        config = apply_action(obs.config, action)
        changed = config if config != obs.config else None
        return Decision(obs, changed, f"{how} {self._describe(action)} (bottleneck {state[0]})",
                        self.guard.predict(config))

    def _watch(self, obs: Observation, predicted: int) -> Decision:
        best_mean = self.means[self.best][0]
        self._low_windows = self._low_windows + 1 if obs.samples_per_s < 0.8 * best_mean else 0
        if self._low_windows >= 3:
            self.done, self.epsilon, self._since_gain, self._low_windows = False, 0.2, 0, 0
            self.means = {obs.config: (obs.samples_per_s, 1)}
            return Decision(obs, None, "throughput fell below 80% of the best for 3 windows: exploring again",
                            predicted)
        return Decision(obs, None, "converged: keeping the best configuration", predicted)

    @staticmethod
    def _describe(action: Action) -> str:
        if action[0] == "move":
            return f"move a worker {action[1]} -> {action[2]}"
        if action[0] == "prefetch":
            return f"prefetch {action[1]:+d}"
        return " ".join(map(str, action))
