"""`hicache-cp replay`, the main job: see `hicache_cp.harness.replay.command`."""
