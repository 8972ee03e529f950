from export.hf import main

if __name__ == "__main__":
    main()
