"""The runner's eager lean step replaced by the compiled one while it serves.

:mod:`services.verifier.compile_swap` builds a CPU target's compiled steps off the critical path;
:class:`CompiledSwapIn` is the :class:`~services.verifier.runner.ModelRunner` side that swaps them in.
"""

from __future__ import annotations


class CompiledSwapIn:
    """:class:`~services.verifier.runner.ModelRunner`'s swap from its eager lean step to the
    compiled one (a base class: it uses the runner's ``compiled``, ``graphed``, ``lean``,
    ``_lean_ok``, ``target``, ``_set_up_step`` and ``warm_up``)."""

    @property
    def can_swap_in_compiled(self) -> bool:
        """True for an eager lean step (a llama target on CPU) that :meth:`use_compiled` can replace."""
        return not self.compiled and not self.graphed and self._lean_ok and self.lean is not None

    def use_compiled(self, rows: tuple[int, ...]) -> float:
        """Replace this runner's eager lean step by the compiled one (sharing its fused int4 packs)
        and warm up its steps of ``rows`` rows: loaded from inductor's disk cache when a background
        build wrote it, else compiled here. Call with no request in flight: the compiled step's bits
        are not the eager step's (:mod:`services.verifier.lean_step`), so a request must run on one
        step kind from its first row to its last, and the caller drops the slots' cached prefixes.

        Returns the warm-up's seconds.
        Raises:
            RuntimeError: not :attr:`can_swap_in_compiled`, or no free KV slot for the warm-up;
                anything the compile or load raises. On any error the runner is eager again, as before.
        """
        if not self.can_swap_in_compiled:
            raise RuntimeError("only an eager lean step on CPU can be replaced by the compiled one")
        eager = self.lean
        self.compiled = True
        try:
            self._set_up_step(self.target, lean=True, share=eager)
            return self.warm_up(rows)
        except BaseException:
            self.compiled, self.native, self.lean, self._lean_call = False, False, eager, None
            raise
