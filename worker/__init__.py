"""The GPU worker: engine, scheduler, adapter pool, HTTP service."""
