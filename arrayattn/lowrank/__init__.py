"""The low-rank family: attention through a small set of landmarks or projected tokens.

- :mod:`.nystrom` -- Nyströmformer and the two-softmax landmark attention;
- :mod:`.pinv` -- the Moore-Penrose pseudo-inverse (SVD or iterative) Nyström needs;
- :mod:`.linformer` -- Linformer; :mod:`.luna` -- Luna (pack, then unpack);
- :mod:`.checks` -- the family's argument checks.
"""

__all__: list[str] = []
