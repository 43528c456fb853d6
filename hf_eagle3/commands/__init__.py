"""The `hf-eagle3` command line (`cli`) and the commands that are not part of another layer: `demo`, `bench`,
`bench-batches` (`bench_batches`) and `tune-tree` (`tune_tree`)."""
