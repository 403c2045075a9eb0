-- room-service's V1 table (DESIGN.md §2.1), as it exists before room-outbox is deployed.
-- The compose file's one-shot `migrate` service then upgrades it in place, the way an
-- existing production table is upgraded.
USE room;

CREATE TABLE IF NOT EXISTS room_outbox (
  id            BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,
  app_code      VARCHAR(64)  NOT NULL DEFAULT '',
  event_id      VARCHAR(64)  NOT NULL,
  event_type    VARCHAR(64)  NOT NULL,
  room_id       VARCHAR(64)  NOT NULL,
  envelope      LONGTEXT     NOT NULL,
  status        VARCHAR(16)  NOT NULL DEFAULT 'pending',
  retry_count   INT          NOT NULL DEFAULT 0,
  last_error    VARCHAR(1024) NULL,
  created_at_ms BIGINT       NOT NULL,
  updated_at_ms BIGINT       NOT NULL,
  UNIQUE KEY uk_room_outbox_event_id (event_id),
  KEY idx_room_outbox_status_id (status, id)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4;
