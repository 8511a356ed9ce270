"""KV-cache policies (one file each): which cached keys of each block stay for later scales (issue 29).

``keep_all`` (the default: nothing evicted), ``keep_recent`` (a recency window, the baseline), ``scalekv``
(ScaleKV, arXiv 2505.19602), ``hack`` (HACK, arXiv 2504.09261). The engine side is ``var_core.engine.kvcache``.
"""
