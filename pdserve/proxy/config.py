"""The proxy's settings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProxyConfig:
    prefill_urls: list[str]
    decode_urls: list[str]
    policy: str = "round_robin"
    mode: str = "pull"  # a flow in proxy/flows: pull | push | colocated (plain load balancing) | auto (per request)
    request_timeout_s: float = 600.0
    meta_url: str = ""  # push: where decode nodes announce their blocks (this proxy's /v1/kv/meta)
    # push: how long D may take to announce its blocks. D announces once it has reserved them, and a
    # D whose pool is full queues the request until blocks free up, as it does in pull mode: so as
    # long as any request may take (a D that cannot announce answers with an error itself).
    meta_timeout_s: float = 600.0
    node_urls: list[str] = field(default_factory=list)  # colocated mode
    kv_both_urls: list[str] = field(default_factory=list)  # auto: colocated nodes that also move KV (--role kv_both)
    api_key: str | None = None  # clients must send it; the proxy also sends it to the nodes
    max_waiting: int | None = None  # requests in flight past which the proxy answers 429
    health_interval_s: float = 1.0
    max_health_failures: int = 3  # failed checks in a row before a node leaves rotation
    nodes_file: str | None = None  # JSON list of nodes, re-read when it changes (see proxy.membership)
    profile: str | None = None  # auto: the `pdserve profile` file placements are priced from
    model_dir: str | None = None  # auto: the model whose tokenizer and chat template the nodes use
    stall_weight: float = 1.0  # auto: a second of delay to each stream decoding, against a second of TTFT
    placement: str = "cost"  # auto: cost, or a baseline rule (proxy/placement.py: Placer)
    remote_prefill_threshold: int = 512  # auto, threshold / scorers rules: uncached tokens past which P prefills
    dashboard: bool = True  # request records, /v1/requests and the live page (proxy/dashboard.py)
    slos: dict[str, float] | None = None  # auto, cost rule: ttft_ms / tpot_ms to keep requests within
