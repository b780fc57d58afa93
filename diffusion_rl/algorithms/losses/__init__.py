"""Policy-gradient losses, one file each (base.py: what they share); LOSSES imports every module here on its first
look-up, which registers them."""
