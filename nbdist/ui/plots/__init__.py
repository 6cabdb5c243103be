"""Matplotlib plots of nbdist's records. Every function takes the data and ``ax=None`` and returns
what it drew (Figure or Axes); none calls ``plt.show()``."""
