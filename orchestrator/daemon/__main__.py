from orchestrator.daemon.run import main

raise SystemExit(main())
