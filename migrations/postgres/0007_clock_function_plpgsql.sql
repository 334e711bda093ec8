-- effectgate_now_ms() in PL/pgSQL. Every write reads it (with its
-- savepoint); as a SQL function with a sub-SELECT it is never inlined, so
-- each call parsed and planned its body again. PL/pgSQL keeps the plan of
-- its statement for the session. Same value: the database clock in ms
-- plus the shift of clock_shift.
CREATE OR REPLACE FUNCTION effectgate_now_ms() RETURNS BIGINT LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN floor(extract(epoch FROM clock_timestamp()) * 1000)::BIGINT
         + (SELECT shift_ms FROM clock_shift);
END
$$;
