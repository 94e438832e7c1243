from bonsai_cli.main import main

main()
