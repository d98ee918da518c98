"""ImageNet-1k archives, WebDataset shards and DALI index files."""
