"""Write WebDataset shards and manifests; see `python scripts/make_shards.py --help`.

Same as the installed console script `tpustream-make-shards`.
"""

import sys

from tpustream.data.write.command import main

if __name__ == "__main__":
    sys.exit(main())
