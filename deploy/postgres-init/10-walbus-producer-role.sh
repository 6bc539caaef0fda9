#!/bin/sh
# Least privilege for the producer (docker-entrypoint-initdb.d, run once on a new data volume):
# a role with REPLICATION and SELECT, not the superuser. The publication is created here by the
# superuser, because FOR ALL TABLES needs one; with an explicit table list the tables' owner
# can create it instead (README, "Least privilege").
set -eu
: "${WALBUS_PRODUCER_PASSWORD:?set WALBUS_PRODUCER_PASSWORD}"
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
     -v role="${WALBUS_PRODUCER_ROLE:-walbus_producer}" -v password="$WALBUS_PRODUCER_PASSWORD" \
     -v db="$POSTGRES_DB" <<'SQL'
CREATE ROLE :"role" WITH LOGIN REPLICATION PASSWORD :'password';
GRANT CONNECT ON DATABASE :"db" TO :"role";
GRANT USAGE ON SCHEMA public TO :"role";
GRANT SELECT ON ALL TABLES IN SCHEMA public TO :"role";
ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO :"role";
SELECT format('CREATE PUBLICATION %I FOR ALL TABLES', 'walbus_' || :'db') \gexec
SQL
