"""Where a text output's time goes between the Scheduler and the TokenizerManager.

Every ``BatchStrOutput`` the Detokenizer sends carries three ``time.monotonic()``
stamps: when the Scheduler made the ``BatchTokenIDOutput`` (just before sending it),
when the Detokenizer took it in and when it sent the text on. The TokenizerManager
adds two of its own, when it took the text in and when it had applied it to the
waiting requests, and sums the four spans between them here. ``CLOCK_MONOTONIC`` is
one clock for every process of a Linux machine, so stamps made in different
processes compare directly.

The spans are latency: what each output waits and works on its way, not CPU time
taken from the Scheduler. With the components in their own processes on cores of
their own, they overlap the Scheduler's next step.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.messages import BatchStrOutput


@dataclass
class OutputPathStats:
    """Sums, over the text outputs received, of the time spent on each part of their way.

    * ``scheduler_to_detokenizer_seconds``: from the ``BatchTokenIDOutput``'s making to
      the Detokenizer's taking it in (the Scheduler's encoding and send, which its step
      time counts too, the transport, the Detokenizer's wake-up and decoding);
    * ``detokenize_seconds``: the Detokenizer's work on it (``Detokenizer.handle_batch``);
    * ``detokenizer_to_manager_seconds``: from there to the TokenizerManager's taking the
      text in (the Detokenizer's encoding and send, the transport, the decoding, and any
      wait for the TokenizerManager's event loop);
    * ``manager_seconds``: the TokenizerManager's applying it to the requests' states
      and waking their callers.
    """

    outputs: int = 0
    scheduler_to_detokenizer_seconds: float = 0.0
    detokenize_seconds: float = 0.0
    detokenizer_to_manager_seconds: float = 0.0
    manager_seconds: float = 0.0

    def add(self, msg: BatchStrOutput, received: float, applied: float) -> None:
        """Count ``msg``, taken in at ``received`` and applied at ``applied`` (monotonic).

        A message without the Detokenizer's stamps is not counted.
        """
        if not msg.detokenizer_sent_at:
            return
        self.outputs += 1
        self.scheduler_to_detokenizer_seconds += (
            msg.detokenizer_received_at - msg.token_ids_created_at)
        self.detokenize_seconds += msg.detokenizer_sent_at - msg.detokenizer_received_at
        self.detokenizer_to_manager_seconds += received - msg.detokenizer_sent_at
        self.manager_seconds += applied - received

    def info(self) -> dict[str, int | float]:
        """The sums as ``get_server_info`` fields (``output_path_*``)."""
        return {
            "output_path_outputs": self.outputs,
            "output_path_scheduler_to_detokenizer_seconds": self.scheduler_to_detokenizer_seconds,
            "output_path_detokenize_seconds": self.detokenize_seconds,
            "output_path_detokenizer_to_manager_seconds": self.detokenizer_to_manager_seconds,
            "output_path_manager_seconds": self.manager_seconds,
        }
