"""arrayattn's asv suite (the folder ``benchmark_dir`` of ``benchmarks/asv.conf.json``)."""
