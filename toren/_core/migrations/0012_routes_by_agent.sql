-- A run pinned to its agent's version is routed agent:NAME@VERSION (issue 31): the listing of an
-- agent's runs finds them all, pinned or not, by the part of the route before '@'. Rerouting
-- (once per run, at its start) is the only update that changes the indexed value.
DROP INDEX toren.actors_runs_by_route;
CREATE INDEX actors_runs_by_route ON toren.actors
    (split_part(route, '@', 1), created_at DESC, actor_id DESC)
    WHERE kind = 'toren.run';
