"""Periodic health checks: ``GET /health`` on every worker; failures leave the pool."""

from __future__ import annotations

import asyncio
import logging

import httpx

from framework.router.workers import Worker, WorkerSet

logger = logging.getLogger("framework.router")


async def check_worker(client: httpx.AsyncClient, worker: Worker, timeout: float) -> None:
    """Mark ``worker`` healthy if its ``/health`` answers 200 within ``timeout``."""
    try:
        response = await client.get(f"{worker.url}/health", timeout=timeout)
        healthy = response.status_code == 200
    except httpx.HTTPError:
        healthy = False
    if healthy != worker.healthy:
        logger.warning("worker %s is %s", worker.url, "back" if healthy else "down")
    worker.healthy = healthy


async def check_all(client: httpx.AsyncClient, workers: WorkerSet, timeout: float) -> None:
    """Check every worker of the pool at once."""
    await asyncio.gather(*(check_worker(client, w, timeout) for w in workers.active()))


async def health_loop(client: httpx.AsyncClient, workers: WorkerSet, interval: float) -> None:
    """Check the workers every ``interval`` seconds until cancelled."""
    # A check slower than the interval counts as a failure: the next one is due.
    while True:
        await asyncio.sleep(interval)
        await check_all(client, workers, timeout=max(interval, 1.0))
