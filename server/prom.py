"""Prometheus exposition of the router's metrics, collected at scrape time into a registry
owned by the call (no module-level registry: several routers may share a process)."""
from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, SummaryMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class _RouterCollector:
    def __init__(self, router, server=None):
        self.router, self.server = router, server

    def collect(self):
        m = self.router.metrics
        req = CounterMetricFamily("aiorouter_requests", "Requests ended, by finish reason", labels=["reason"])
        for reason, n in m.requests_finished.items():
            req.add_metric([reason], n)
        yield req
        yield GaugeMetricFamily("aiorouter_requests_active", "Requests in the router", value=m.active)
        yield GaugeMetricFamily("aiorouter_tuning_resolving", "1 while a drift re-solve of the thresholds runs "
                                "(one event-loop task)", value=int(self.router.tuning is not None
                                                                    and self.router.tuning.resolving))
        yield GaugeMetricFamily("aiorouter_thresholds_tuned", "1 once the start-up threshold solve is over "
                                "(until then every delayed-batching threshold is 1)", value=int(self.router.tuned))
        if self.server is not None:
            yield GaugeMetricFamily("aiorouter_http_in_flight", "HTTP generation requests in flight",
                                    value=self.server.in_flight)
        tok = CounterMetricFamily("aiorouter_tokens", "Output tokens committed, by model", labels=["model"])
        ho = CounterMetricFamily("aiorouter_handoffs", "Handoffs between models", labels=["src", "dst"])
        for (a, b), n in m.handoffs.items():
            ho.add_metric([a, b], n)
        used = GaugeMetricFamily("aiorouter_kv_pages_used", "KV pages held by live requests", labels=["model"])
        total = GaugeMetricFamily("aiorouter_kv_pages_total", "KV pages in the pool", labels=["model"])
        cached = GaugeMetricFamily("aiorouter_kv_pages_cached", "KV pages the prefix cache holds (evictable once "
                                   "no request holds them; POST /reset_prefix_cache frees those)", labels=["model"])
        preempt = CounterMetricFamily("aiorouter_kv_preemptions", "Sequences whose KV was dropped for lack of pages "
                                      "(recomputed later)", labels=["model"])
        hits = CounterMetricFamily("aiorouter_prefix_cache_hit_tokens", "Prompt tokens admissions found in the "
                                   "prefix cache (not computed)", labels=["model"])
        prefill = CounterMetricFamily("aiorouter_prefill_tokens", "Tokens computed as part of a prefill (a prompt, "
                                      "a chunk of one, or the extend of a request handed back)", labels=["model"])
        queue = GaugeMetricFamily("aiorouter_queue_length", "Requests ready to compute", labels=["model"])
        pend = GaugeMetricFamily("aiorouter_pending", "Requests parked while a peer serves them", labels=["model"])
        delay = SummaryMetricFamily("aiorouter_admission_delay_seconds", "Ready-to-launch delay", labels=["model"])
        batch = HistogramMetricFamily("aiorouter_batch_size", "Sequences per step", labels=["model"])
        kv = self.router.kv_usage()  # read now, on the loop that owns the pools
        for name, mm in m.models.items():
            tok.add_metric([name], mm.tokens_committed)
            total.add_metric([name], mm.kv_pages_total)
            if name in kv:  # (a router not started has no pools to read)
                used.add_metric([name], kv[name].pages_used)
                cached.add_metric([name], kv[name].pages_cached)
                preempt.add_metric([name], kv[name].preemptions)
                hits.add_metric([name], kv[name].prefix_hit_tokens)
                prefill.add_metric([name], kv[name].prefill_tokens)
                queue.add_metric([name], kv[name].ready)
                pend.add_metric([name], kv[name].parked)
            delay.add_metric([name], mm.admission_delay_count, mm.admission_delay_sum)
            edges = [1, 2, 4, 8, 16, 32, 64, 128, 256]
            cum = [sum(c for b, c in mm.batch_sizes.items() if b <= e) for e in edges]
            n = sum(mm.batch_sizes.values())
            buckets = [(str(e), c) for e, c in zip(edges, cum)] + [("+Inf", n)]
            batch.add_metric([name], buckets, sum_value=sum(b * c for b, c in mm.batch_sizes.items()))
        yield from (tok, ho, used, total, cached, preempt, hits, prefill, queue, pend, delay, batch)
        # a leak of tasks or a dead subserver shows here before anywhere else
        tasks = GaugeMetricFamily("aiorouter_subserver_tasks", "Subserver tasks, by state", labels=["state"])
        tasks.add_metric(["running"], self.router.num_tasks)
        tasks.add_metric(["stopped"], len(self.router.dead_tasks()))
        yield tasks
        restarts = CounterMetricFamily("aiorouter_subserver_restarts", "Subserver tasks restarted with a fresh "
                                       "engine state after they died", labels=["model"])
        down = GaugeMetricFamily("aiorouter_model_down", "1 while the model's subserver is not serving "
                                 "(restarting, or down for good)", labels=["model"])
        health = self.router.health()
        for name in self.router.names:
            restarts.add_metric([name], m.subserver_restarts[name])
            down.add_metric([name], int(name in health))
        yield from (restarts, down)
        try:
            yield GaugeMetricFamily("aiorouter_event_loop_tasks", "asyncio tasks in the serving event loop",
                                    value=len(asyncio.all_tasks()))
        except RuntimeError:  # scraped off the loop (no running loop): nothing to count
            pass


def render_metrics(router, server=None) -> tuple[bytes, str]:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_RouterCollector(router, server))
    return generate_latest(reg), CONTENT_TYPE_LATEST
