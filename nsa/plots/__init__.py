"""Every figure nsa draws, and the only place matplotlib is imported: the run report's (`run`, `gates`),
`nsa compare`'s (`compare`, `gates`), the retrieval heatmaps of `nsa eval` and `nsa compare` (`retrieval`) and
the benchmarks' (`bench`). The modules that write reports and tables call these with plain data."""
