"""The autoscaler's configuration (a `baton serve` section), apart from the autoscaler itself so
that the configuration tree (`cluster.config`) loads without the router's HTTP app or the
simulator (which `cluster.autoscaler` needs)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["AutoscalerConfig"]


@dataclass
class AutoscalerConfig:
    """The autoscaler's knobs (a `baton serve` section; off by default)."""

    enabled: bool = field(
        default=False,
        metadata={
            "flag": "autoscale",
            "help": "grow and shrink the pools from the router's TTFT/TPOT and queue signals",
        },
    )
    interval_s: float = field(
        default=10.0, metadata={"flag": "autoscale_interval", "help": "seconds between two autoscaler decisions"}
    )
    window_s: float = field(
        default=30.0, metadata={"flag": "autoscale_window", "help": "seconds of recent traffic each decision looks at"}
    )
    slo_ttft_s: float = field(
        default=2.0, metadata={"flag": "autoscale_slo_ttft", "help": "TTFT target in seconds (p90 over the window)"}
    )
    slo_tpot_s: float = field(
        default=0.1, metadata={"flag": "autoscale_slo_tpot", "help": "TPOT target in seconds (p90 over the window)"}
    )
    # Not 0 by default: dropping the last prefill worker moves every prefill onto the decode pool,
    # which then grows again (a flap seen in the simulator's load step).
    min_prefill_workers: int = field(
        default=1,
        metadata={"example": 0, "help": "the autoscaler keeps at least this many prefill workers (0 allows colocated)"},
    )
    max_prefill_workers: int = field(default=4, metadata={"help": "the autoscaler adds no prefill worker beyond this"})
    min_decode_workers: int = field(
        default=1, metadata={"help": "the autoscaler keeps at least this many decode workers"}
    )
    max_decode_workers: int = field(default=4, metadata={"help": "the autoscaler adds no decode worker beyond this"})
    scale_up_at: float = field(
        default=0.8,
        metadata={"flag": "autoscale_up_at", "help": "grow a pool when its pressure (signal / SLO) exceeds this"},
    )
    scale_down_at: float = field(
        default=0.3,
        metadata={
            "flag": "autoscale_down_at",
            "example": 0.2,
            "help": "shrink a pool when its pressure stays below this",
        },
    )
    down_after: int = field(
        default=6,
        metadata={"flag": "autoscale_down_after", "help": "consecutive low-pressure decisions before a pool shrinks"},
    )
    cooldown_s: float = field(
        default=60.0,
        metadata={
            "flag": "autoscale_cooldown",
            "help": "seconds a pool is left alone after it changed "
            "(after growing, it shrinks no sooner than twice this)",
        },
    )

    def __post_init__(self) -> None:
        for name in ("interval_s", "window_s", "slo_ttft_s", "slo_tpot_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"autoscaler {name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.min_prefill_workers <= self.max_prefill_workers:
            raise ValueError(
                f"need 0 <= min_prefill_workers <= max_prefill_workers, got "
                f"{self.min_prefill_workers}, {self.max_prefill_workers}"
            )
        if not 1 <= self.min_decode_workers <= self.max_decode_workers:
            raise ValueError(
                f"need 1 <= min_decode_workers <= max_decode_workers, got "
                f"{self.min_decode_workers}, {self.max_decode_workers}"
            )
        if not 0 <= self.scale_down_at < self.scale_up_at:
            raise ValueError(
                f"need 0 <= autoscale_down_at < autoscale_up_at (hysteresis), got "
                f"{self.scale_down_at}, {self.scale_up_at}"
            )
        if self.down_after < 1 or self.cooldown_s < 0:
            raise ValueError("autoscale_down_after must be >= 1 and autoscale_cooldown >= 0")
