"""Direct-preference / forward-process losses (Diffusion-DPO, DiffusionNFT, AWM), one file each with the algorithm
that runs it and the helpers only it uses; base.py holds what they share. LOSSES imports every module here on its
first look-up, which registers them."""
