"""SGLang glue: `storage.HiCacheCpStorage`, an L3 storage backend SGLang loads
as `--hicache-storage-backend dynamic` (imports sglang; never imported by
the library)."""
