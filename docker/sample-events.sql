-- 1,000 room events for the compose stack's dashboards and traces, inserted the way
-- room-service does (V1 columns, status left to its default). Run it as often as you like:
--   docker-compose exec -T mysql mysql -uroot -proom room < docker/sample-events.sql
-- Event types: RoomHeatChanged goes to the noop sink, the others to the (fake) Tencent IM.
INSERT INTO room_outbox (app_code, event_id, event_type, room_id, envelope, created_at_ms, updated_at_ms)
SELECT e.app_code, e.event_id, e.event_type, e.room_id,
       JSON_OBJECT('event_id', e.event_id, 'event_type', e.event_type, 'app_code', e.app_code,
                   'room_id', e.room_id, 'room_version', e.room_version, 'occurred_at_ms', e.ms,
                   'payload', JSON_OBJECT('user_id', CONCAT('u', e.room_version % 97), 'sample', TRUE)),
       e.ms, e.ms
FROM (
  WITH RECURSIVE n (i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000),
  run (id, ms) AS (SELECT REPLACE(UUID(), '-', ''), CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS UNSIGNED))
  SELECT 'default' AS app_code,
         CONCAT('sample-', run.id, '-', n.i) AS event_id,
         ELT(1 + n.i % 4, 'RoomUserJoined', 'RoomGiftSent', 'RoomMicChanged', 'RoomHeatChanged') AS event_type,
         CONCAT('room-', n.i % 20) AS room_id,
         n.i AS room_version,
         run.ms AS ms
  FROM n CROSS JOIN run
) AS e;
