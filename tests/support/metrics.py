"""Reading a running server's /metrics."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def scrape(base_url: str) -> Samples:
    return parse_samples(httpx.get(f"{base_url}/metrics", timeout=10).text)


def parse_samples(text: str) -> Samples:
    """Every sample of a Prometheus exposition, each of which must appear once."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in samples, f"{sample.name} {sample.labels} appears twice"
            samples[key] = sample.value
    return samples
