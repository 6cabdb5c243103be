"""Reports people read: numbers with their units, as HTML tables in notebooks and text elsewhere.

Owns unit formatting and parsing (:mod:`.units`) and the one table renderer (:mod:`.table`: one unit
per column, in its header; HTML and text). Used by the runtime's status, the benchmark records and
the memory report alike; plots take their formatters from here too.

May import: the standard library only. Everything else may import it.
"""
