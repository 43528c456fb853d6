"""EAGLE-3 decoding inside `generate`: the loop (`generate`), its parts (`drafter`, `tree`, `verify`, `ngram`,
`exact_attention`), the tree shape chosen per machine (`calibration`) and checked within each call (`online`), the
CPU weight layout for multi-token forwards (`cpu_layout`), and what makes a draft usable with a target
(`compatibility`, `pipelines`)."""
