-- How long a node asks to be taken for alive after each heartbeat: the time of the beat plus
-- its own node timeout. Another node takes it for dead only once this has passed and its own
-- node timeout too, so nodes of one fleet with different timeouts never take a live one for
-- dead between two of its beats. NULL for a beat of a version before it.
ALTER TABLE dacapo_nodes ADD COLUMN alive_until BIGINT;
