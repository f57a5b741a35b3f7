#!/usr/bin/env python
"""Check a data set: counts per class, empty images, bad boxes, missing or unreadable
image files, duplicate ids, size and aspect histograms. Exit status 1 on errors.

    python tools/check_dataset.py --config configs/my_coco.yaml --split train [key=value ...]
"""

import sys

from detector.data.check import main

if __name__ == "__main__":
    sys.exit(main())
