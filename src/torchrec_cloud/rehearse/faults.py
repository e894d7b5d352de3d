"""The faults a cluster brings, each replayed as the kubelet, the node lifecycle and the
cloud do it (worst real case first), firing once the run has logged a step:

``--preempt POD@STEP``
    a drain (``kubectl drain``, the eviction API): DisruptionTarget, SIGTERM to the pod,
    SIGKILL after its terminationGracePeriodSeconds.
``--reclaim POD@STEP``
    a spot reclaim: the kubelet's graceful node shutdown (kubernetes v1.33
    ``pkg/kubelet/nodeshutdown/nodeshutdown_manager.go``, killPods) gives the pod
    min(terminationGracePeriodSeconds, the profile's ``spot.reclaim_grace_s``: GKE 15 s of
    the 30 s notice, Azure 30 s, AWS 120 s), then SIGKILL; the pod is Failed with
    DisruptionTarget (TerminationByKubelet). No other pod gets a signal.
``--evict POD@STEP``
    a kubelet eviction under node memory pressure: DisruptionTarget, SIGTERM, and a hard
    threshold's grace of 0, which the kubelet raises to its minimum of 2 s
    (``pkg/kubelet/kuberuntime/kuberuntime_container.go``, minimumGracePeriodInSeconds).
``--kill POD@STEP``
    a process death (an OOM kill): SIGKILL to every process of the pod, exit 137, no
    condition: a counted failure.
``--lose POD@STEP``
    the node vanishes: every process of the pod is frozen (SIGSTOP), so no TCP reset or
    FIN reaches a peer, and pod 0's name stops answering. Nothing reports on the pod: it
    stays Running until the node is NotReady (node-monitor-grace-period, 50 s) and the
    unreachable taint's tolerationSeconds (300 s, the DefaultTolerationSeconds admission
    plugin) have passed, then Terminating (the taint eviction) until PodGC deletes it once
    the Node object is gone (``pkg/controller/podgc/gc_controller.go``: quarantine 40 s,
    checked every 20 s), marking it Failed with DisruptionTarget. Only then do the
    controllers replace it. The profile's ``lost_node`` holds these times; ``--delay_scale``
    scales them with the controllers' delays.

Every ``--flag`` may be repeated; each fault fires once, on the first attempt of its pod
that has logged the step since it started. That pod's trainer waits after the step until the
fault comes (``preemption.REHEARSAL_HOLD_ENV``): the rehearsal reads the run's records a
poll later, and a fault set between two checkpoints must not land after the second one on a
slow or busy machine.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Callable, Optional

from torchrec_cloud.config import ConfigError
from torchrec_cloud.preemption import REHEARSAL_HOLD_ENV
from torchrec_cloud.rehearse.pods import Attempt

KINDS = ("preempt", "reclaim", "evict", "kill", "lose")
EVICTION_GRACE_S = 2.0  # kuberuntime_container.go, minimumGracePeriodInSeconds


@dataclasses.dataclass
class Fault:
    kind: str  # one of KINDS
    pod: int
    step: int
    fired: bool = False
    fired_at: Optional[float] = None  # time.monotonic() when it fired
    fired_step: Optional[int] = None  # the last step the run had logged then

    @classmethod
    def parse(cls, kind: str, text: str, nodes: int) -> "Fault":
        m = re.fullmatch(r"(\d+)@(\d+)", text.strip())
        if not m:
            raise ConfigError(kind, f"must be POD@STEP (e.g. 1@20), got {text!r}")
        pod, step = int(m.group(1)), int(m.group(2))
        if pod >= nodes:
            raise ConfigError(kind, f"pod {pod} does not exist: the job has pods 0..{nodes - 1}")
        return cls(kind, pod, step)


@dataclasses.dataclass
class LostNode:
    """When a lost node's pod is Terminating (taint eviction) and when it is deleted (PodGC),
    from the profile's ``lost_node`` times, scaled."""

    attempt: Attempt
    evict_at: float
    gc_at: float
    evicted: bool = False


class Faults:
    """Fires the faults on the pods and runs the node lifecycle of the lost ones."""

    def __init__(self, faults: list[Fault], pods, controller, reclaim_grace_s: float, lost_node: dict,
                 delay_scale: float, say: Callable[[str], None]) -> None:  # fmt: skip
        self.faults = faults
        self.pods = pods
        self.controller = controller
        self.reclaim_grace_s = reclaim_grace_s
        self.lost_node = lost_node
        self.delay_scale = delay_scale
        self.say = say
        self.lost: list[LostNode] = []

    def hold_env(self, index: int) -> dict[str, str]:
        """The environment of a new attempt of pod ``index``: the step to wait at for the
        next fault set for that pod, if any."""
        steps = [f.step for f in self.faults if f.pod == index and not f.fired]
        return {REHEARSAL_HOLD_ENV: str(min(steps))} if steps else {}

    def tick(self, steps_since: Callable[[Attempt], int]) -> None:
        for fault in self.faults:
            target = self.controller.current.get(fault.pod)
            if fault.fired or target is None or target.deleting or target.lost:
                continue
            step = steps_since(target)
            if step >= fault.step:
                fault.fired, fault.fired_at, fault.fired_step = True, time.monotonic(), step
                self._fire(fault, target, step)
        now = time.monotonic()
        for lost in list(self.lost):
            if not lost.evicted and now >= lost.evict_at:
                lost.evicted = True
                self.pods.terminate(lost.attempt, 0, "node unreachable past the toleration: evicted", disrupted=True)
            if now >= lost.gc_at:
                self.lost.remove(lost)
                lost.attempt.disrupted = True  # PodGC: Failed, DisruptionTarget (DeletionByPodGC)
                self.pods.kill(lost.attempt, "the Node object is gone: PodGC deletes the pod")

    def _fire(self, fault: Fault, target: Attempt, step: int) -> None:
        grace = self.controller.template.grace_s
        if fault.kind == "preempt":
            self.pods.terminate(target, grace, f"drained at step {step}", disrupted=True)
        elif fault.kind == "reclaim":
            grace = min(grace, self.reclaim_grace_s)
            self.pods.terminate(target, grace, f"spot node reclaimed at step {step}", disrupted=True)
        elif fault.kind == "evict":
            grace = min(grace, EVICTION_GRACE_S)
            self.pods.terminate(target, grace, f"evicted at step {step} (node memory pressure)", disrupted=True)
        elif fault.kind == "kill":
            self.pods.kill(target, f"killed at step {step}")
        else:
            self.pods.freeze(target, f"node lost at step {step}")
            if target.index == 0:
                self.controller.address.point_to(None, vanished=True)
            t = self.lost_node
            evict_s = (t["not_ready_after_s"] + t["toleration_s"]) * self.delay_scale
            gc_s = evict_s + t["pod_gc_s"] * self.delay_scale
            self.say(f"{target.name}: Running with no kubelet; evicted in {evict_s:.1f} s, deleted by PodGC in "
                     f"{gc_s:.1f} s")  # fmt: skip
            now = time.monotonic()
            self.lost.append(LostNode(target, now + evict_s, now + gc_s))
