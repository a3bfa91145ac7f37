"""The family of norms, as data: every layer takes a norm's name as a parameter.

    layer_norm       y = scale * (x - mean) * rstd + beta,  rstd = 1/sqrt(var + eps)
    rms_norm         y = scale * x * rstd,                  rstd = 1/sqrt(mean(x^2) + eps)
    add_layer_norm   h = x + residual (rounded once), y = layer_norm(h)
    add_rms_norm     h = x + residual (rounded once), y = rms_norm(h)

scale is gamma, or 1 + gamma with ``zero_centered_gamma`` (formed in the compute dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NORMS", "Norm", "norm"]


@dataclass(frozen=True)
class Norm:
    """One member of the family.

    Attributes:
        name: the prefix of its functions (``<name>_forward``, ``<name>_backward``).
        title: how tables and plots name it.
        centred: subtracts the row mean, and has a shift beta (LayerNorm); else RMSNorm.
        residual: adds a residual first (h = x + residual) and returns h.
        eps: the default eps.
    """

    name: str
    title: str
    centred: bool
    residual: bool
    eps: float

    @property
    def forward_inputs(self) -> tuple[str, ...]:
        """The (M, D) arrays the forward reads."""
        return ("x", "residual") if self.residual else ("x",)

    @property
    def forward_outputs(self) -> tuple[str, ...]:
        """The (M, D) arrays the forward writes."""
        return ("y", "h") if self.residual else ("y",)

    @property
    def backward_inputs(self) -> tuple[str, ...]:
        """The (M, D) arrays the backward reads (dh is the residual stream's gradient)."""
        return ("x", "dy", "dh") if self.residual else ("x", "dy")

    @property
    def backward_outputs(self) -> tuple[str, ...]:
        """The (M, D) arrays the backward writes."""
        return ("dx", "dresidual") if self.residual else ("dx",)

    @property
    def params(self) -> tuple[str, ...]:
        """The (D,) parameters."""
        return ("gamma", "beta") if self.centred else ("gamma",)


NORMS: dict[str, Norm] = {n.name: n for n in (
    Norm("layer_norm", "LayerNorm", centred=True, residual=False, eps=1e-5),
    Norm("rms_norm", "RMSNorm", centred=False, residual=False, eps=1e-6),
    Norm("add_layer_norm", "add+LayerNorm", centred=True, residual=True, eps=1e-5),
    Norm("add_rms_norm", "add+RMSNorm", centred=False, residual=True, eps=1e-6),
)}


def norm(name: str) -> Norm:
    """The family member called ``name`` (ValueError naming the choices if there is none)."""
    try:
        return NORMS[name]
    except KeyError:
        raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {name!r}") from None
