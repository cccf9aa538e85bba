-- The handlers that already succeeded for an envelope (JSON list of "module/name"), so that
-- RetryScope::FailedHandlers does not run them again after a restart.
ALTER TABLE dacapo_inbox ADD COLUMN succeeded TEXT;
