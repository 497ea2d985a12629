"""What a quantization pass or a load did, layer by layer (its `Layer` records), rendered for people."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..units import GIB, format_gib
from .layer import Layer


@dataclass
class QuantReport:
    title: str = "quantization"
    records: list[Layer] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # notes the short report shows too: where layers run otherwise than stored (e.g. NVFP4 re-quantized at load)
    headline_notes: list[str] = field(default_factory=list)

    @property
    def quantized(self) -> list[Layer]:
        """The layers this pass quantized (or loaded quantized)."""
        return [r for r in self.records if r.format is not None and not r.earlier]

    @property
    def earlier(self) -> list[Layer]:
        """The layers that came to this pass already quantized, left as they were."""
        return [r for r in self.records if r.earlier]

    @property
    def linear_count(self) -> int:
        return sum(r.linear for r in self.records)

    @property
    def kept(self) -> list[Layer]:
        return [r for r in self.records if r.format is None]

    def bytes_before(self) -> int:
        return sum(r.bytes_before for r in self.records)

    def bytes_after(self) -> int:
        return sum(r.bytes_after for r in self.records)

    def bytes_saved(self, names) -> int:
        """How many bytes fewer the layers `names` take than before (the ones a caller installs)."""
        return sum(r.bytes_before - r.bytes_after for r in self.records if r.name in names)

    def method_counts(self, records: list[Layer] | None = None) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.quantized if records is None else records:
            counts[r.format] = counts.get(r.format, 0) + 1
        return counts

    def summary_line(self) -> str:
        return f"quantized {len(self.quantized)}/{self.linear_count} linear layers"

    def weights_line(self) -> str:
        before, after = self.bytes_before(), self.bytes_after()
        return (f"weights: {format_gib(before, '.4g')} -> {format_gib(after, '.4g')} "
                f"(saved {format_gib(before - after, '.4g')})")

    def brief(self) -> list[str]:
        """The report in two lines for the node: the formats; the memory saved, the layers kept and the
        headline notes."""
        counts, earlier = self.method_counts(), self.method_counts(self.earlier)
        first = self.summary_line()
        if counts:
            first += ": " + _counts_text(counts)
        if earlier:
            first += "; already quantized: " + _counts_text(earlier)
        second = self.weights_line()
        if self.kept:
            second += f"; {len(self.kept)} kept in original precision"
        return [first, "; ".join([second, *self.headline_notes])]

    def render(self) -> str:
        lines = [self.summary_line(), self.weights_line()]
        counts = self.method_counts()
        if counts:
            lines.append("formats: " + _counts_text(counts))
        earlier = self.method_counts(self.earlier)
        if earlier:
            lines.append("already quantized, left alone: " + _counts_text(earlier))
        lines.extend(self.notes)
        lines.extend(self.headline_notes)
        if self.kept:
            lines.append(f"kept in original precision ({len(self.kept)}):")
            lines.extend(f"  {r.name}: {r.reason}" for r in self.kept)
        return "\n".join(lines)


def _counts_text(counts: dict[str, int]) -> str:
    """`{format: count}` -> "<format> x<count>" parts, formats in name order."""
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
