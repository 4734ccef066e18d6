from ingot.cli.main import app

app()
