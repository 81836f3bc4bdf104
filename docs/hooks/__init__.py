"""The MkDocs hooks of this site and the modules they share, importable as the package docs.hooks.

MkDocs (mkdocs.yml, ``hooks:``) loads each hook file by its path, as a module named after that
path, with the hook's folder on ``sys.path`` only while the file runs. So the hook files
(tables.py, flow.py) put the repository root on ``sys.path`` first and import everything else as
``docs.hooks.NAME``: each module then has one name, the same under MkDocs, under pytest
(tests/unit/test_docs_*.py) and under ``python -m docs.hooks.readme``, and no module of this folder
can be shadowed by, or shadow, a top-level module of the same name. The modules themselves import
nothing of Baton: what they need of it (the configuration schema, the state machines' tables)
they ask a child process for.

- tables.py: hook, ``<!-- table: NAME -->`` and ``<!-- config: reference -->``;
- flow.py: hook, ``<!-- flow: NAME -->``: the state diagrams and the end reasons;
- models.py: hook, ``<!-- models: table -->``: the model families, from the model registry; and
  the README's family list (``python -m docs.hooks.models --check``);
- results.py: bench/results/*.json by name, number formatting, the Markdown table;
- tables_*.py: the table builders, one module per docs page or kind of table;
- config_reference.py: the configuration reference;
- readme.py: the README's headline numbers (``python -m docs.hooks.readme --check``).
"""
