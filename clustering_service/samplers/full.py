"""Full participation: every candidate, every round."""

from __future__ import annotations

from clustering_service.samplers.base import Sampler, SelectionInput, SelectionMethod, SelectionOutput
from clustering_service.state import RunState


class FullSampler(Sampler):
    method = SelectionMethod.FULL

    def select(self, request: SelectionInput, state: RunState) -> SelectionOutput:
        self.check_params(request.params)  # it takes none: a set parameter is a mistake worth reporting
        # num_to_select is deliberately ignored: "full" means everyone who is available.
        return SelectionOutput(selected=tuple(request.candidates.tolist()))
