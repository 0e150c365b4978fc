"""The command line, and only it: `python -m rpcompile {demo, plan, simulate, train, finetune}`.

The top layer of the package (ir < passes < runtime < driver < models, finetune < cli): each module
turns a command's arguments into a call of a library below it. Nothing imports this package but
`rpcompile.__main__`; examples and users import the libraries (`rpcompile`, `rpcompile.finetune`,
`rpcompile.models`).

    main.py      the parser and the commands plan and simulate; one line and exit 2 on bad input
    demo.py      `demo`: train `rpcompile.models.zoo.TinyLlama` on this repository's text, print the IRs
    train.py     `train --config run.json`: scripted training of a byte-level Llama on a text file
    finetune.py  `finetune`: its options (argparse) -> `rpcompile.finetune.FinetuneConfig`
"""
