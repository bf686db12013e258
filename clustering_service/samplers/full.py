"""Full participation: every candidate, every round."""

from __future__ import annotations

from fairfl.sampling import RunState, Sampler, SelectionInput, SelectionOutput


class FullSampler(Sampler):
    uniform = True  # everyone: every candidate's chance is 1

    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        # num_to_select is deliberately ignored: "full" means everyone who is available.
        return SelectionOutput(selected=tuple(request.candidates.tolist()))
