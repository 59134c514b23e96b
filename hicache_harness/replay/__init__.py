"""`hicache-cp replay`, the main job: see `hicache_harness.replay.command`."""
