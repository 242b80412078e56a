"""Probe: a trainer-side expectation checked through the engine after a publish.

The trainer greedy-decodes a few tokens from a prompt with its own model and records the chosen
tokens and their log-probabilities. After loading, the publisher asks the engine for the same
and fails that engine's result on a mismatch: a stale, mis-scaled or wrong adapter shows up here.

A probe only catches a stale engine (one still serving version N-1) when N-1's log-probs on the
probe's tokens differ from N's by more than ``atol``. Between two close training steps they
often do not (a 1 % change of ``lora_B`` moves them by ~0.01 on the tiny test model, under the
default 0.05). Given the previous version's log-probs (``previous_logprobs``, or ``previous=``
in :meth:`Probe.from_model`), a probe states its power (:attr:`Probe.separation`,
:attr:`Probe.detects_previous`, :meth:`Probe.describe`), warns when it cannot tell the two
versions apart, and :meth:`Probe.strict` tightens ``atol`` to half the separation. See
docs/verification.md.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from lorasync.errors import ConfigError, LoraSyncWarning

# Smallest tolerance strict() sets: below it, float32 engines' own rounding (~1e-5..1e-4 on
# these log-probs) could fail a correct engine.
STRICT_FLOOR = 1e-3

__all__ = ["Probe"]


@dataclass(frozen=True)
class Probe:
    """Expected greedy continuation of ``prompt_ids``.

    Args:
        prompt_ids: prompt token ids.
        expected_ids: the trainer model's greedy tokens.
        expected_logprobs: their log-probabilities (None: compare tokens only).
        atol: allowed absolute log-prob difference (bf16 engines need ~0.05–0.1).
        previous_logprobs: the previous version's log-probs of the same tokens after the same
            prompt (the trainer's model before this step), to state what the probe detects.
            Not sent to engines.

    Raises:
        ConfigError: token ids that are not a non-empty sequence of ints >= 0 (bools, floats, a
            string, a bare int), log-probs that are not finite numbers, or log-prob tuples of
            the wrong length.

    Warns:
        LoraSyncWarning: ``previous_logprobs`` are given and within ``atol`` of the expected
            ones: an engine still serving the previous version would pass.
    """

    prompt_ids: tuple[int, ...]
    expected_ids: tuple[int, ...]
    expected_logprobs: tuple[float, ...] | None = None
    atol: float = 0.05
    previous_logprobs: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", token_ids(self.prompt_ids, what="prompt_ids"))
        object.__setattr__(self, "expected_ids", token_ids(self.expected_ids, what="expected_ids"))
        if self.expected_logprobs is not None:
            object.__setattr__(self, "expected_logprobs", _logprobs(self.expected_logprobs, what="expected_logprobs"))
            if len(self.expected_logprobs) != len(self.expected_ids):
                raise ConfigError("expected_logprobs must have one value per expected token")
        check_atol(self.atol)
        if self.previous_logprobs is not None:
            object.__setattr__(self, "previous_logprobs", _logprobs(self.previous_logprobs, what="previous_logprobs"))
            if self.expected_logprobs is None or len(self.previous_logprobs) != len(self.expected_ids):
                raise ConfigError("previous_logprobs need expected_logprobs and one value per expected token")
            if not self.detects_previous:
                warnings.warn(self.describe() + "; use Probe.strict() or a longer / more specific prompt", LoraSyncWarning, stacklevel=3)

    # -- power ------------------------------------------------------------------------------

    @property
    def separation(self) -> float | None:
        """Largest |expected - previous| log-prob over the tokens: how far apart the two
        versions are on this probe (None without ``previous_logprobs``)."""
        if self.previous_logprobs is None or self.expected_logprobs is None:
            return None
        return max(abs(a - b) for a, b in zip(self.expected_logprobs, self.previous_logprobs))

    @property
    def detects_previous(self) -> bool | None:
        """Whether an engine serving exactly the previous version fails this probe (its
        log-probs leave the ``atol`` band somewhere); None when unknown."""
        separation = self.separation
        return None if separation is None else separation > self.atol

    def describe(self) -> str:
        """One line on what this probe can detect."""
        separation = self.separation
        if separation is None:
            return (
                f"probe of {len(self.expected_ids)} tokens, atol {self.atol}: detects changes that move a log-prob by "
                f"more than {self.atol} (give previous_logprobs to know whether that covers one training step)"
            )
        verdict = "would FAIL (detected)" if self.detects_previous else "would PASS (not detected)"
        return (
            f"probe of {len(self.expected_ids)} tokens, atol {self.atol}: this version and the previous one differ by at "
            f"most {separation:.4g} in log-prob, so an engine still serving the previous version {verdict}"
        )

    def strict(self, *, floor: float = STRICT_FLOOR) -> Probe:
        """This probe with ``atol`` lowered to half its separation, so an engine serving the
        previous version fails it while one serving this version passes with margin.

        Args:
            floor (`float`): the smallest tolerance accepted (engine rounding must fit in it;
                float32 engines: ~1e-3; bf16 engines need ~0.05, so strict mode suits them only
                when versions are that far apart).

        Returns:
            `Probe`: a copy with ``atol = min(atol, separation / 2)``.

        Raises:
            ConfigError: no ``previous_logprobs``, or versions closer than ``2 * floor`` on
                this probe (no tolerance can separate them from engine rounding).
        """
        separation = self.separation
        if separation is None:
            raise ConfigError("strict() needs previous_logprobs (Probe.from_model(..., previous=old_model))")
        atol = min(self.atol, separation / 2)
        if atol < floor:
            raise ConfigError(
                f"this version and the previous one differ by at most {separation:.3g} in log-prob on this probe, too "
                f"little to tell apart from engine rounding (floor {floor}); use a longer prompt, more tokens "
                "(max_tokens=), or probe less often than every step"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LoraSyncWarning)
            return replace(self, atol=atol)

    @classmethod
    def from_model(
        cls,
        model: Any,
        prompt_ids: Sequence[int],
        *,
        max_tokens: int = 8,
        atol: float = 0.05,
        previous: Any = None,
        strict: bool = False,
    ) -> Probe:
        """Record ``model``'s greedy continuation (a HF causal LM, e.g. the trainer's PEFT model).

        Args:
            model: the model of the version being published.
            prompt_ids (`Sequence[int]`): the prompt.
            max_tokens (`int`, defaults to 8): tokens to decode.
            atol (`float`, defaults to 0.05): allowed log-prob difference.
            previous (*optional*): the previous version's model (or a callable with the same
                forward); its log-probs of the same tokens become ``previous_logprobs``.
            strict (`bool`, defaults to `False`): return :meth:`strict` of the probe.

        Returns:
            `Probe`: the expectation.

        Raises:
            ConfigError: ``prompt_ids`` not a non-empty sequence of token ids in the model's
                vocabulary, ``strict`` without ``previous``, ``max_tokens`` not an int >= 1,
                ``atol`` not a number >= 0, or versions too close (see :meth:`strict`).
        """
        if strict and previous is None:
            raise ConfigError("strict=True needs previous= (the previous version's model)")
        prompt_ids = token_ids(prompt_ids, what="prompt_ids")
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if isinstance(vocab, int) and max(prompt_ids) >= vocab:
            raise ConfigError(
                f"prompt_ids holds token id {max(prompt_ids)}, outside the model's vocabulary of {vocab}; "
                "pass ids from this model's tokenizer"
            )
        check_max_tokens(max_tokens)
        check_atol(atol)
        # On the model's device: a trainer's model usually sits on its GPU.
        device = next((p.device for p in model.parameters()), torch.device("cpu")) if hasattr(model, "parameters") else torch.device("cpu")
        ids = torch.tensor([list(prompt_ids)], device=device)
        tokens: list[int] = []
        logprobs: list[float] = []
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = model(input_ids=ids).logits[0, -1].float()
                lp = torch.log_softmax(logits, dim=-1)
                tok = int(torch.argmax(lp))
                tokens.append(tok)
                logprobs.append(float(lp[tok]))
                ids = torch.cat([ids, torch.tensor([[tok]], device=device)], dim=1)
        before = None
        if previous is not None:
            with torch.no_grad():
                # One teacher-forced pass: the previous version's log-prob of each token chosen.
                rows = torch.log_softmax(previous(input_ids=ids[:, :-1]).logits[0].float(), dim=-1)[len(prompt_ids) - 1 :]
            before = tuple(float(rows[i, t]) for i, t in enumerate(tokens))
        with warnings.catch_warnings():
            if strict:
                warnings.simplefilter("ignore", LoraSyncWarning)  # strict() fixes what it warns about
            probe = cls(prompt_ids, tuple(tokens), tuple(logprobs), atol, before)
        return probe.strict() if strict else probe

    def mismatch(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> str | None:
        """Why the engine's answer differs from the expectation; None if it matches."""
        got = [int(t) for t in ids]
        if got != list(self.expected_ids):
            return f"greedy tokens {got} != expected {list(self.expected_ids)}"
        if self.expected_logprobs is not None and logprobs is not None:
            for i, (a, b) in enumerate(zip(logprobs, self.expected_logprobs)):
                if not math.isfinite(a) or abs(a - b) > self.atol:
                    return f"token {i} logprob {a:.5f} differs from expected {b:.5f} by more than {self.atol}"
        return None


def token_ids(value: object, *, what: str) -> tuple[int, ...]:
    """``value`` as a tuple of token ids; ConfigError unless it is a non-empty 1-D sequence of
    ints >= 0 (a list, a 1-D tensor or array; not a string, a bare int, bools or floats, which
    ``int()`` would silently turn into other tokens)."""
    hint = f"{what} must be a non-empty sequence of token ids (ints >= 0), e.g. tokenizer(text).input_ids"
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ConfigError(f"{hint}; got a {value.dim()}-D tensor of shape {tuple(value.shape)} (pass one row: ids[0])")
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"{hint}; got {type(value).__name__} {value!r:.60}")
    out: list[int] = []
    for i, t in enumerate(value):
        if isinstance(t, torch.Tensor) and t.dim() == 0:
            t = t.item()
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ConfigError(f"{hint}; {what}[{i}] is {type(t).__name__} {t!r:.40}")
        out.append(int(t))
    if not out:
        raise ConfigError(f"{hint}; got an empty sequence")
    return tuple(out)


def _logprobs(value: object, *, what: str) -> tuple[float, ...]:
    """``value`` as a tuple of finite floats; ConfigError otherwise (NaN would fail every
    engine, a string or bool is not a log-probability)."""
    hint = f"{what} must be a sequence of finite log-probabilities (floats), one per expected token"
    if isinstance(value, torch.Tensor):
        value = value.tolist() if value.dim() == 1 else value
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(f"{hint}; got {type(value).__name__} {value!r:.60}")
    out: list[float] = []
    for i, x in enumerate(value):
        if isinstance(x, torch.Tensor) and x.dim() == 0:
            x = x.item()
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
            raise ConfigError(f"{hint}; {what}[{i}] is {type(x).__name__} {x!r:.40}")
        out.append(float(x))
    return tuple(out)


def check_atol(atol: object, *, what: str = "atol") -> None:
    """Raises ConfigError unless ``atol`` is a number >= 0 (not a bool, not NaN)."""
    if isinstance(atol, bool) or not isinstance(atol, (int, float)) or not atol >= 0:
        raise ConfigError(f"{what} must be a number >= 0 (an allowed log-prob difference, e.g. 0.05), got {atol!r}")


def check_max_tokens(max_tokens: object, *, what: str = "max_tokens") -> None:
    """Raises ConfigError unless ``max_tokens`` is an int >= 1 (not a bool)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"{what} must be an int >= 1 (tokens the probe decodes), got {max_tokens!r}")


async def run_probe(engine: Any, probe: Probe, name: str | None) -> tuple[str | None, Exception | None]:
    """Run ``probe`` through ``engine`` on adapter ``name`` (None: the base model).

    Returns:
        ``(why, cause)``: ``why`` is None only on a pass (design invariant 11: a probe that cannot
        run verifies nothing); ``cause`` is the error that kept it from running, if any.
    """
    try:
        ids, logprobs = await engine.agreedy(name, list(probe.prompt_ids), len(probe.expected_ids))
        return probe.mismatch(ids, logprobs), None
    except Exception as exc:  # noqa: BLE001 - unverified, whatever the engine raised
        return f"the probe could not run ({type(exc).__name__}: {exc}); publish again once the engine answers", exc
